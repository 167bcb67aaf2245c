"""pdist: distributed training built by hand, to learn it and trust it."""
__version__ = "0.1.0"
