"""The engine: many requests through one model, step by step (no HTTP here; imports `model`, never `app`).

- `request`: what goes in and comes out (EngineRequest, RequestOutput, error kinds); `sampling`: the parameters,
  their bounds and the device-side sampler; `stopping`: stop ids and strings; `structured_output`: grammar masks.
- `scheduler` (with `prefix_cache`) decides each step; `core` (EngineCore) runs it: schedule → execute → update;
  `spec_decode` proposes tokens (prompt lookup, a draft model) that the core verifies exactly in its decode pass;
  `cuda_graphs` replays decode steps on a GPU; `sizing` turns memory settings into KV-cache slots.
- `build` turns the server's settings into a core (loading, the memory-fit check, its /info), `cpu_tuning` what
  start-up tunes to the CPU (dtype, threads, OpenMP, malloc); `core_process` runs the core in its own process,
  `transport` its ZMQ side, `core_loop` is its busy loop, `wire` the messages, `client` the fronts' handle on it,
  `output_processor` the one loop over its outputs (detokenizing, stop strings).
- `generate` is the library loop over a core; `sample` the command-line sampler (`python -m engine.sample`).
"""
