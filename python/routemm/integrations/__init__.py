"""Adapters to other libraries' extension points (PyTorch custom ops, the transformers experts);
each imports its library only when it is imported or used. Built on the layers below cli."""
