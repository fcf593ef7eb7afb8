"""The default policy, shipped as package data (read with importlib.resources)."""
