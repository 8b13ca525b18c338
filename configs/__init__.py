"""Hydra configs shipped as package data (read with importlib.resources)."""
