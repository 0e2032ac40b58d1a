"""The command line: `atomtrain train / sample / data / plan / profile / bench`."""
