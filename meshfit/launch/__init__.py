"""`meshfit launch`: starting, watching and stopping the processes of a job, here or on Ray."""
