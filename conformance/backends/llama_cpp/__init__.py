"""llama.cpp through llama-cpp-python: ``engine`` (the engine, in-process) and ``backend`` (the registered
``llama-cpp`` backend: the engine in a child process behind the protocol server), with the expectations files
of its configurations beside them (``expectations/``)."""
