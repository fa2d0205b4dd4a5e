"""Config functions (torchtitan style), one module per model family:
`--module train_configs.<family> --config <function>`."""
