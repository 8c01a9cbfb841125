"""What the scheduler half hands its workers: one step's facts (``facts``) and
the finished prefills it pins at once, in process or over ``ipc://``
(``pins``)."""
