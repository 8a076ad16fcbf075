from splitserve.openai.server import main

main()
