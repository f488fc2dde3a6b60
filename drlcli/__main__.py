"""``python -m drlcli`` (and ``torchrun -m drlcli``) runs the CLI."""

from .cli import main

if __name__ == "__main__":
    main()
