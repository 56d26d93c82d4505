"""What a run leaves behind and how it is scored: output folders, files, plots, clustering metrics."""
