"""`python -m routemm`: the command line and its demos. Built on the layers below integrations."""
