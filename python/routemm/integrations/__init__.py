"""Thin adapters to other libraries' extension points; each imports its library only when used."""
