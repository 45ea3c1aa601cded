"""disttrain.bench: benchmarks of collectives and strategies, with tables and reports."""
