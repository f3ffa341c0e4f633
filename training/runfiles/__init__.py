"""The run-files room (shared base): the table of names on disk, the one JSON record reader, the one schema of user-typed values, the CLI harness, file arguments, progress."""
