"""Adapters that attach the expert cache to model libraries (torch lives here)."""
