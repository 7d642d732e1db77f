"""Job specs: one module per section of the YAML (`models`, `calibration`, `resources`,
`evaluation`, `tracking`), the whole job (`job.JobSpec`) and its parser (`parse`)."""
