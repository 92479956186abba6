"""The Arrow IPC format (file, stream, Parquet read in place): writer, checks, format adapter,
Hugging Face ``datasets`` layouts."""
