"""What a job writes and reads back: catalog rows and parts, events and timeline,
MLflow runs and registry, storage, progress lines, `lorp status`."""
