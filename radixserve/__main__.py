from radixserve.entrypoints.cli import main

main()
