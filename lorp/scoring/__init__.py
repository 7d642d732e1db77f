"""What some selection methods score candidates by: the calibration loss with blocks or
sub-layers removed in memory, and the repair-aware window's scores."""
