"""The library's commands, one module each: ``init``, ``evaluate`` (``drl eval``), ``verify``,
``info``, ``forget`` (forget, purge, restore), ``export``, ``predict``, ``demo``. Learning a stage is
the ``stage/`` folder; the benchmark is ``benchmark/``. Each command takes explicit paths, options
and a device, raises ``DrlError`` subclasses for what a user can cause, reports progress through
an optional callback and returns a typed result; nothing here prints (``cli/`` does)."""
