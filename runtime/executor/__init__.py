"""Running the model one step: the model runner, CUDA-graph decode, tensor-parallel driver and workers."""
