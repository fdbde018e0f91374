"""Runs of different parallel layouts compared per logical tensor (docs/layouts.md).

placement.py reads each record's relation to its logical tensor off the wire;
mesh.py says what each run's layout is and whether the session merges;
merge.py merges one run's ranks' records of a step into logical records
(exact statistics, summed sketches, assembled tensors) and checks that
replicas agree; gather.py holds a run's ranks' steps until a step is whole.
"""
