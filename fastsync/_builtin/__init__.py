"""fastsync's built-in plugins, each registered through the ``fastsync`` entry-point group."""
