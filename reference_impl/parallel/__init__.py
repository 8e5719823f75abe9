"""The parallelisms: the mesh of named axes, one module per way of splitting the work, and the
registry that applies them in order (`registry.parallelize`)."""
