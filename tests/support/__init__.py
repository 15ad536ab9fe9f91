"""Code the tests share; no test module imports another.

- :mod:`.ranks`         ranks as threads; each rank's exception comes back with its traceback
- :mod:`.loopback`      hand-made plans and loopback communicators run as ranks
- :mod:`.plans`         hand-built valid plans and exactly checkable data for the schedule and runtime tests
- :mod:`.plan_checker`  an independent checker of plans (shares no code with the planner)
- :mod:`.cli`           ``python -m blink_horovod ...`` as a user runs it
- :mod:`.horovod_jobs`  ``horovodrun`` / ``blinkrun`` jobs under a timeout, for the ops tests

``pytest.ini`` puts ``tests/`` on the import path (``pythonpath``), so tests
import these as ``support.ranks`` and so on.
"""
