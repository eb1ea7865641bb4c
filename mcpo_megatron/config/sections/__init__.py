"""The sections of the run configuration, one module per group of sections; :mod:`..schema` assembles them."""
