"""Text for calibration and judgement: corpora (`corpora`) and the token windows cut from
them (`windows`)."""
