"""MLflow: a job's runs, the Model Registry's versions and aliases, registered variants
pulled back, and the best ones written out for serving."""
