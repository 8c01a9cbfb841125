"""The runtime: one event-loop thread per process (``loop``), the queue other
threads hand it work through (``entry``) and several driven loops on one
virtual clock (``group``, for the simulation)."""
