"""The catalog tables: a job's Delta table and its rows, the organisation's shared catalog,
their protocol and ranking columns, and the formats before Delta."""
