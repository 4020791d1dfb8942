"""The engine layer of the server (no HTTP here): the engine core's busy loop (`core_loop`), the process that runs
it (`core_process`), the messages between them and the fronts (`wire`), the fronts' handle on it (`client`) and the
one loop over its outputs (`output_processor`). The core itself is `model.engine_core` (pure PyTorch)."""
