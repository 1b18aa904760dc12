//! Safetensors checkpoints: reading single files, `*.index.json` shard sets and
//! Hugging Face folders lazily through the mmap; writing sharded checkpoints
//! atomically; and Accelerate's offload folder format.
