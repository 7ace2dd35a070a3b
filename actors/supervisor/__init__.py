"""The supervisor's room: the process `nexus up` becomes (``python -m actors.supervisor``,
`__main__.py`), built from `SupervisorConfig`. It starts every other role as a process by its
module name (``python -m actors.run ROLE``), never by import."""
