"""Config functions (torchtitan style), one module per model family:
`--module train_configs.<family> --config <function>`.

`torchtitan_ext` is imported first: its torch-version mends (`torchtitan_ext.torch_compat`)
must be in place before the config modules import torchtitan."""

import torchtitan_ext  # noqa: F401
