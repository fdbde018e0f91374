"""ingest stage of the comparison server: client messages read, validated and decoded into steps.

``wire`` reads a tensor piece without copying its payload; ``pieces`` holds a
stream's pieces until their step's records arrive; ``manifest`` is what a
stream has declared; ``layouts`` resolves the records' names and shapes once
per layout; ``decode`` turns a StepRecords into a :class:`~.step.StepData`,
which is all that compare, align and detect see.  ``msprobe`` reads msprobe's
dump.json files as the messages a run would have streamed (``twinstep
compare-dumps``, through twinstep.server.offline).
"""
