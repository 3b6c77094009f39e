"""Layers of real models: ops wired to the weights of a model file (MoeLayer, from GGUF). Built on
plans, ops and formats."""
