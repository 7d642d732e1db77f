"""What a job writes and reads back: catalog tables, events and timeline,
MLflow runs and registry, storage, progress lines, `lorp status`."""
