"""The reliability scenarios and the processes they start, shipped with the bench.

``kvstore bench reliability`` (``bench/reliability.py``) runs the scenarios at full size and
tabulates their figures; ``tests/reliability/`` runs the same ones at small sizes and asserts on
the figures. They live here rather than under ``tests/`` so that an installed kvstore (whose
wheel has no ``tests/``) can run the bench, and its child processes can start by module name
(``python -m bench.reliability_kit.load_worker``) with no path set up for them.

- ``scenarios``: each scenario as a function that runs it and returns its figures;
- ``serve_process``: ``kvstore serve`` in a child process that a scenario can kill and restart;
- ``crash_client``, ``load_worker``, ``memory_churn``: the scenarios' child processes, which
  the tests also import for their sequences and expected KV.

Nothing here imports ``tests`` (shipped code never does); the tests import from here.
"""
