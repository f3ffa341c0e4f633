"""The checkpoint room (shared base): the one checkpoint format, its reader, writer, verification and FSDP shards."""
