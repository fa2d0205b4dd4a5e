"""transformer_debug with a disk that fills during its second checkpoint save (test of the
disk-full stop): importing this module, as `--module fault_configs` does on every rank, makes
DCP's file writer write half a shard and raise ENOSPC on its second save."""

import errno

from torch.distributed.checkpoint.filesystem import FileSystemWriter

from train_configs.transformer import transformer_debug

_write_data = FileSystemWriter.write_data
_saves = {"count": 0}


def _write_data_until_the_disk_fills(self, plan, planner):
    _saves["count"] += 1
    if _saves["count"] < 2:
        return _write_data(self, plan, planner)
    shard = self.fs.concat_path(self.path, "__partial_0.distcp")
    with self.fs.create_stream(shard, "wb") as stream:
        stream.write(b"\0" * 4096)
    raise OSError(errno.ENOSPC, "No space left on device")


FileSystemWriter.write_data = _write_data_until_the_disk_fills


def transformer_debug_disk_fills():
    return transformer_debug()
