"""What a candidate practises with: graders for the drills, mock questions, naive versions that
fail on purpose, broken jobs to debug and a graph-break example.

The two self-contained trainers a candidate pastes, `reference_impl/notebook.py` and
`reference_impl/interview_core.py`, stay at the package's top level: they run as
`python -m reference_impl.notebook` and as a script.
"""
