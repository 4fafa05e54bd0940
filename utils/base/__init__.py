"""The bottom layer: files (atomic writes, disk space), output names (layout) and the one logger; it imports
nothing of the package."""
