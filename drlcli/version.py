"""The version of drlcli: one source (pyproject.toml reads it; every record drl writes carries it)."""

__version__ = "0.1.0"
