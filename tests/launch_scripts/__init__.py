"""Worker scripts for the launch tests, and the harness that runs them (harness.py)."""
