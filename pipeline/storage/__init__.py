"""Where a job's results live for every node: the storage (a directory or a `pyarrow.fs`
URI, atomic writes), the bases stored once beside the variants, and create-if-absent on S3."""
