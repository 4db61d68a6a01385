"""The ``fullshard`` command line (``fullshard/cli/__main__.py``); one module per subcommand."""
