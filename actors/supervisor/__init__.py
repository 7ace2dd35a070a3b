"""The supervisor's room: the process `nexus up` becomes (``python -m actors.supervisor``,
`__main__.py`), built from `transport.cluster.SupervisorConfig` (on the transport floor because
`nexus up` builds it too). `supervisor.py` runs the broker and the children, `children.py` is one
child process and what starting it needs, `scaling.py` answers scale requests. It starts every
other role as a process by its module name (``python -m actors.run ROLE``), never by import."""
