"""``python -m disttrain`` runs the command-line interface."""

from disttrain.cli import main

raise SystemExit(main())
