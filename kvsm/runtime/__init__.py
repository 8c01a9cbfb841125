"""The runtime: one event-loop thread per process (``loop``; what its thread
runs each iteration, ``dispatch``), the queue other threads hand it work
through (``entry``), several driven loops on one virtual clock (``group``, for
the simulation) and a clean stop on every exit of the process (``stop``)."""
