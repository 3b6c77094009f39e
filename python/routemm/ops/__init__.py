"""The ops: the expert-ID matmul (dense and over GGML block stacks), the quantised dense matmul and
its routing, the MoE gate and experts block; on buffers (into an encoder), arrays and tensors.
Built on formats and core."""
