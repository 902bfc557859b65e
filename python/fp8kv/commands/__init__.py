"""The commands of `fp8kv` (see fp8kv.cli), one module each: `add_arguments(parser)` declares its
arguments, `run(args)` runs it and returns the exit status, raising `errors.CommandError` for a
user error; `HELP` is its line in `fp8kv --help`."""
