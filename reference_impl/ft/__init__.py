"""Survivors keep training: replica groups that lose a member without stopping.

`python -m reference_impl.ft --replicas R --nproc-per-replica N [train flags]` runs R
copies of the data-parallel job (a replica each, N ranks inside it) that average their
gradients every step over whichever replicas are alive (torchft's Lighthouse decides the
quorum). A killed rank takes down only its replica; the launcher restarts that replica,
which copies the model, optimizer and step from a live peer and trains again.
"""
