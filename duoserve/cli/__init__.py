"""The command line: one typer app per stage (``trace``, ``train``, ``evaluate``, ``run``), shared options in
``common``. Presentation only: what a library user would need lives in the package, callable from Python."""
