"""Writes prompts.jsonl, the training prompts for self-distilled drafter heads.

The chat model answers these prompts and the draft heads learn to predict its answers, so the set
mixes the tasks a small chat model is given: advice, explanations, creative writing, rewriting,
translation, summarisation, question answering (closed-book and over a given paragraph), math,
code, how-tos, extraction and classification, comparisons and definitions. Hand-written prompts
come first; templated ones pair a handful of phrasings with topic lists, each topic taking the
phrasings in turn (no randomness: running this module rewrites the file byte for byte).

    python -m verispec.train.make_prompts
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

OUTPUT = Path(__file__).with_name("prompts.jsonl")

HANDWRITTEN: dict[str, tuple[str, ...]] = {
    "conversation": (
        "Hi! How are you today?",
        "I just started my first job as a software developer and I feel like everyone knows more "
        "than me. Is that normal?",
        "What are some good ways to wind down in the evening without looking at a screen?",
        "My roommate keeps leaving dirty dishes in the sink. How can I bring it up without "
        "starting a fight?",
        "Can you recommend a few hobbies that don't cost much money?",
        "I have a job interview tomorrow for a marketing position. Any last-minute tips?",
        "What's a good way to keep a conversation going with someone I just met at a party?",
        "I keep procrastinating on my thesis. What practical steps could help me get started?",
        "I want to start running but I get out of breath after two minutes. How should I begin?",
        "What should I think about before adopting a dog?",
        "My grandmother is turning 90 next month. What are some thoughtful gift ideas?",
        "I'm nervous about giving a toast at my brother's wedding. How do I write a good one?",
        "How can I spend less on groceries each week?",
        "I feel sleepy every afternoon even though I sleep eight hours. What could I try?",
        "Tell me something surprising about octopuses.",
        "I want to learn to cook but I only have a tiny kitchen and one pan. Where do I start?",
        "What are some polite ways to say no when a coworker asks for help and I'm too busy?",
        "We're planning a weekend trip with two kids under five. How do we keep the car ride "
        "calm?",
        "I'd like to read more books this year. How can I build the habit?",
        "Do you have any advice for someone learning to play the guitar as an adult?",
        "My apartment has no balcony. Which plants could I grow indoors?",
        "What's a good way to apologise to a friend after I forgot their birthday?",
        "I manage a small team and one person seems unmotivated lately. How should I approach "
        "it?",
        "Can you help me plan a simple, healthy breakfast routine for a busy week?",
        "I'm thinking about going back to university at 35. Is it too late?",
        "What's your favourite kind of question to answer?",
        "I get really anxious before exams even when I've studied. Any advice?",
        "My teenage son spends all evening on video games. How can I talk to him about it "
        "without nagging?",
        "I want to ask for a raise but I don't know how to start the conversation. Can you "
        "help?",
        "Can you suggest a fun activity for a rainy Sunday afternoon at home?",
        "I've been feeling lonely since working from home full time. What could help?",
        "My friend and I disagree about where to go on holiday: she wants the beach, I want the "
        "mountains. How can we decide?",
        "I keep losing my keys. Do you have any tricks for remembering where I put things?",
        "What are some good questions to ask at the end of a job interview?",
        "I have 30 minutes for lunch. What can I make quickly with eggs, spinach and bread?",
        "I'd like to volunteer in my community. How do I find something that suits me?",
        "Is it better to pay off my credit card or start saving first?",
        "Thanks for the help yesterday! Can you remind me how to say thank you in Japanese?",
        "I'm hosting a dinner for six people and one of them is vegan. What could I cook that "
        "everyone will enjoy?",
        "How do I stay focused when working from a noisy café?",
        "I'll try to give you the full picture. I'm 28, I work as an accountant in a mid-sized "
        "firm, and the pay is good, but I find the work dull and I dread Mondays. On weekends I "
        "build furniture in my parents' garage, and friends have started asking to buy my "
        "tables. I have about eight months of savings. Part of me wants to quit and try making "
        "furniture full time, and part of me thinks that is reckless because I have never run "
        "a business. I don't want a yes or no answer. Could you help me think through the "
        "questions I should answer before deciding, and maybe a way to test the idea without "
        "quitting straight away?",
        "My sister and I are planning our parents' 40th wedding anniversary. We have a budget "
        "of about 1,500 euros, around 35 guests including some elderly relatives who can't "
        "walk far, and the date is a Saturday in late May. Our parents love Italian food, old "
        "photographs and dancing to music from the seventies, but they dislike surprises and "
        "long speeches. Could you suggest a plan for the day, including the kind of venue to "
        "look for, food, one or two small activities, and a rough timeline from arrival to "
        "the end of the evening?",
    ),
    "explanation": (
        "Why is the sky blue?",
        "How do vaccines train the immune system?",
        "What causes the seasons on Earth?",
        "Explain how a refrigerator keeps food cold.",
        "Why did the Roman Empire split into eastern and western halves?",
        "How does compound interest work? Give a small example with numbers.",
        "What happens inside a battery when it powers a flashlight?",
        "Why do onions make people cry when they are cut?",
        "Explain what a hash table is and why looking up a key is fast.",
        "How do airplanes stay in the air?",
        "Why was the printing press so important in Europe?",
        "I'm studying for a biology test and my notes say that enzymes are proteins that speed "
        "up chemical reactions without being used up, that each enzyme has an active site "
        "shaped to fit a particular substrate, and that high temperatures can denature them. I "
        "can memorise these sentences, but I don't really understand them. Could you explain "
        "what an active site is, why the shape matters, what denaturing actually does to the "
        "enzyme, and why a fever that is too high can be dangerous? Please use an analogy if "
        "you can, and keep it at the level of a secondary school student.",
        "Why does bread dough rise?",
        "How does GPS work out where my phone is?",
        "Explain the difference between weather and climate.",
        "What does a CPU cache do, and why does it make programs faster?",
        "Why do we have leap years?",
        "How do noise-cancelling headphones work?",
        "Why does ice float on water?",
        "What caused the Great Depression?",
        "How does a search engine decide which pages to show first?",
    ),
    "creative": (
        "Write a short poem about the first snow of winter.",
        "Write a four-line poem about a cat watching birds through a window.",
        "Write a 100-word story about a lighthouse keeper who finds a message in a bottle.",
        "Come up with five slogans for a bicycle repair shop.",
        "Write a haiku about morning coffee.",
        "Write a short bedtime story about a turtle who wants to fly.",
        "Write a limerick about a forgetful chef.",
        "Invent a name and a one-paragraph description for a new board game.",
        "Write the opening paragraph of a mystery novel set on a night train.",
        "Write a short dialogue between a robot and a child meeting for the first time.",
        "Write a thank-you note to a neighbour who watered my plants while I was away.",
        "Give me three catchy names for a podcast about gardening.",
        "Write three slogans for a vegetarian restaurant.",
        "Write three slogans for a campaign to recycle more glass.",
        "Suggest a short slogan for a music festival by a lake.",
        "Write a product description for a water bottle that keeps drinks cold for 24 hours.",
        "Write a short motivational message for a friend running her first marathon.",
        "Write a short fable with a moral about patience.",
        "Write a funny two-sentence horror story about a printer.",
        "Describe a sunset over the ocean in three sentences without using the word 'orange'.",
        "Write a birthday message for a coworker I don't know very well.",
        "Write the lyrics of a short chorus for a song about summer holidays.",
        "Write a letter from a dog to its owner who just left for work.",
    ),
    "rewriting": (
        "Fix the grammar in this sentence: 'Me and him goes to the store yesterday.'",
        "Rewrite this sentence to sound more formal: 'Hey, can you send me that report ASAP?'",
        "Paraphrase: 'The meeting has been postponed until further notice due to unforeseen "
        "circumstances.'",
        "Make this sentence shorter without losing its meaning: 'At this point in time we are "
        "not in a position to be able to offer you a refund.'",
        "Correct the spelling mistakes: 'I recieved your mesage and will definately reply "
        "tommorow.'",
        "Rewrite in the passive voice: 'The committee approved the new budget.'",
        "Rewrite this message so it sounds friendlier: 'Your payment is late. Pay now.'",
        "Turn this shopping list into one sentence: apples, bread, milk, eggs.",
        "Rewrite this for a ten-year-old: 'Photosynthesis is the process by which plants "
        "convert light energy into chemical energy.'",
        "Fix the punctuation and capitalisation: 'lets eat grandma said the boy'",
        "Rewrite in the past tense: 'She walks to the station, buys a ticket and waits for the "
        "train.'",
        "Make this paragraph more concise: 'Our team is very excited and extremely happy to "
        "announce that we have finally, after a lot of hard work, launched our brand new "
        "website, which we think you will really like.'",
        "Paraphrase this sentence in three different ways: 'The weather ruined our picnic.'",
        "Rewrite this post to sound professional: 'omg our new app update is finally out, go "
        "check it!!!'",
        "Reword this sign so it sounds positive: 'Don't forget to lock the door.'",
        "Split this long sentence into shorter ones: 'The library, which was built in 1902 and "
        "renovated twice, is closing for repairs next week, so all borrowed books must be "
        "returned by Friday or they can be dropped in the box outside.'",
        "Fix the subject-verb agreement: 'The list of items are on the table.'",
        "Rewrite this sentence without the jargon: 'We need to leverage our synergies to "
        "move the needle going forward.'",
    ),
    "translation": (
        "Translate to English: 'Je voudrais réserver une table pour deux personnes ce soir.'",
        "Translate to English: '¿Dónde está la estación de tren más cercana?'",
        "Translate to English: 'Ich habe meinen Regenschirm im Bus vergessen.'",
        "What does 'Il fait très beau aujourd'hui' mean in English?",
        "Translate from Spanish to English: 'Mi hermana trabaja en un hospital en Madrid.'",
        "Translate from German to English: 'Können Sie mir bitte helfen?'",
        "Translate to English: 'Nous avons visité le musée hier après-midi.'",
        "Translate to English: 'Me gusta leer antes de dormir.'",
        "Translate to English: 'Das Wetter wird morgen kälter.'",
        "Translate this French sentence into English: 'Le chat dort sur le canapé.'",
        "How do you say 'good night' in French, Spanish and German?",
        "Translate to English: 'Wir fahren am Wochenende in die Berge.'",
        "Translate to English: 'El museo abre a las diez de la mañana.'",
        "Translate to English: 'Pouvez-vous parler plus lentement, s'il vous plaît ?'",
    ),
    "qa": (
        "What is the capital of Australia?",
        "Who wrote 'Pride and Prejudice'?",
        "How many bones are in the adult human body?",
        "What is the boiling point of water at sea level in Fahrenheit?",
        "Which planet is known as the Red Planet?",
        "In what year did people first walk on the Moon?",
        "What is the largest ocean on Earth?",
        "Which gas do plants take in from the air to make food?",
        "Who painted the Mona Lisa?",
        "What is the chemical symbol for gold?",
        "How many continents are there, and what are they called?",
        "What language is spoken in Brazil?",
        "What is the longest river in Africa?",
        "Who developed the theory of general relativity?",
        "What is the smallest prime number?",
        "How many minutes are there in a day?",
        "Which organ pumps blood around the body?",
        "What is the freezing point of water in Celsius?",
        "Who was the first woman to win a Nobel Prize?",
        "What is the hardest natural substance?",
        "Which country has the largest population in South America?",
        "What is the main ingredient of guacamole?",
        "How many sides does a hexagon have?",
        "What do bees make from nectar?",
    ),
    "math": (
        "What is 15% of 240?",
        "Solve for x: 3x + 7 = 22.",
        "A rectangle is 8 cm long and 5 cm wide. What are its area and perimeter?",
        "What is the average of 12, 15, 20 and 33?",
        "Convert 3/8 to a decimal and to a percentage.",
        "If a train travels 180 km in 2 hours and 15 minutes, what is its average speed?",
        "Simplify the fraction 42/56.",
        "What is the next number in the sequence 2, 6, 12, 20, 30, ...? Explain the pattern.",
        "How many different ways can you arrange the letters of the word 'CAT'?",
        "A pizza is cut into 8 equal slices. If Sam eats 3 slices and Lea eats 2, what fraction "
        "of the pizza is left?",
        "What is the square root of 144, and what is 144 squared?",
        "Round 3.14159 to two decimal places.",
        "If I flip a fair coin twice, what is the probability of getting two heads?",
        "A shirt costs $40 and is on sale for 25% off. What is the sale price?",
        "What is the least common multiple of 6 and 8?",
        "Expand (x + 3)(x - 2).",
    ),
    "coding": (
        "Write a Python function that checks whether a string is a palindrome.",
        "What does this Python code print? `print([x * 2 for x in range(4)])`",
        "Explain what this snippet does:\n```python\nwith open('data.txt') as f:\n"
        "    lines = [line.strip() for line in f]\n```",
        "How do I reverse a list in Python?",
        "What is the difference between a list and a tuple in Python?",
        "This function should return the average of a list but gives wrong results. Find the "
        "bug:\n```python\ndef average(xs):\n    total = 0\n    for x in xs:\n        total = x\n"
        "    return total / len(xs)\n```",
        "How do I read a CSV file in Python with the csv module?",
        "Write a SQL query that selects all customers who live in the city 'Lyon'.",
        "Explain what a dictionary comprehension is in Python, with an example.",
        "What does `if __name__ == '__main__':` mean in a Python script?",
        "Write a one-line Python expression that sums the squares of the numbers from 1 to 10.",
        "Explain this line:\n```python\nnums = sorted(nums, key=lambda n: -n)\n```",
        "What is the output of this code?\n```python\na = [1, 2, 3]\nb = a\nb.append(4)\n"
        "print(a)\n```",
        "What is a Python virtual environment and why would I use one?",
        "Explain the difference between `==` and `is` in Python.",
        "How do I handle a `KeyError` when reading from a dictionary?",
        "Write a Bash command that counts the lines in every .txt file in the current folder.",
        "What does the `git status` command show?",
        "Explain what this regular expression matches: `^\\d{3}-\\d{4}$`",
        "Why does `0.1 + 0.2 == 0.3` print False in Python?",
        "I wrote this function to count the words in a file, but it crashes on an empty line and "
        "I also think it counts punctuation as part of words. Can you explain both problems "
        "and give me a fixed version?\n```python\ndef count_words(path):\n    counts = {}\n"
        "    for line in open(path):\n        first = line.split()[0]\n"
        "        for word in line.split():\n            counts[word] = counts[word] + 1\n"
        "    return counts\n```\nI'd also like the words to be counted case-insensitively, so "
        "that 'The' and 'the' are the same word.",
    ),
    "howto": (
        "How do I change a flat tyre on a car?",
        "List five tips for writing a good CV.",
        "Give me a step-by-step recipe for pancakes.",
        "How do I make a monthly budget for the first time?",
        "List ten things to pack for a weekend camping trip.",
        "How do I get a coffee stain out of a white shirt?",
        "Give me a simple 20-minute workout I can do at home without equipment.",
        "How can I make my home Wi-Fi more secure?",
        "List some ways to reduce plastic waste at home.",
        "How do I boil an egg so the yolk is still soft?",
        "What are the steps to repot a houseplant?",
        "How do I write a polite email asking for a deadline extension?",
        "List the steps to hang a picture frame straight.",
        "How do I clean a cast-iron pan?",
    ),
    "extraction": (
        "Extract the dates from this text: 'The conference runs from 3 March to 5 March 2024, "
        "and the registration deadline is 15 February.'",
        "Extract all the names of people mentioned: 'Maria met Tom at the library, and later "
        "they called Dr. Okafor about the results.'",
        "Which of these are fruits and which are vegetables: carrot, apple, spinach, banana, "
        "broccoli, mango?",
        "List the numbers in this sentence and what each one counts: 'The school has 450 "
        "students, 32 teachers and 12 classrooms.'",
        "Is this email spam? 'Congratulations! You have won a free cruise. Click the link and "
        "enter your bank details to claim it.'",
        "Extract the email addresses from this text: 'Write to sales@example.com for quotes or "
        "help@example.org for support.'",
        "Label each word as a noun, verb or adjective: run, happy, table, sing, blue, river.",
        "What is the main topic of this sentence: 'The city council voted to add new bike lanes "
        "along the river next spring.'",
        "Classify these animals as mammals, birds or reptiles: eagle, dolphin, lizard, bat, "
        "penguin, crocodile.",
        "List the ingredients and quantities in this recipe step: 'Mix two cups of flour with a "
        "pinch of salt, then add three eggs and a cup of milk.'",
        "Identify the language of each greeting: 'Guten Morgen', 'Buenos días', 'Bonjour', "
        "'Buongiorno'.",
        "Sort these words alphabetically: pear, banana, cherry, apple, mango.",
        "Find the prices in this text and add them up: 'A coffee costs $3.50, a muffin $2.25 "
        "and a juice $4.'",
        "Is the following statement a fact or an opinion? 'Chocolate ice cream is the best "
        "flavour.'",
        "Extract the city names from this sentence: 'We flew from Lisbon to Berlin, took a "
        "train to Prague and ended the trip in Vienna.'",
        "Pull out the action items from this note: 'Team sync: Ana will book the venue, Raj "
        "sends the invitations by Tuesday, and everyone reviews the budget draft.'",
        "Which of these words are synonyms of 'happy': cheerful, gloomy, joyful, tired, "
        "content?",
        "Give the phone number and opening hours mentioned here: 'Call us on 555-0142, Monday "
        "to Friday, 9am to 5pm.'",
        "Turn the following notes into a table with the columns Name, Role, Start date and "
        "Office: 'Priya Nair joins us as a data analyst on 2 September and will sit in the "
        "Leeds office. Our new designer, Jonas Berg, starts a week later in Oslo. Carla Ruiz "
        "moves from sales to customer success on 1 October and stays in Madrid. Finally, Ben "
        "Osei starts as an intern on 16 September, working remotely from Accra for the first "
        "month and then from Leeds.'",
    ),
    "comparison": (
        "What is the difference between a virus and a bacterium?",
        "Compare renting and buying a home: what are the pros and cons of each?",
        "Which is better for a beginner photographer, a smartphone or an entry-level camera?",
        "What's the difference between 'affect' and 'effect'?",
        "How is a crocodile different from an alligator?",
        "Compare electric cars and petrol cars in terms of running costs.",
        "What is the difference between an introvert and a shy person?",
        "How do tea and coffee compare in caffeine and taste?",
    ),
}

# Short passages, each summarised and questioned below; distinct from the evaluation set's.
PASSAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "The town of Millbrook opened its first public library in 1911 with a donation of 300 "
        "books from a local doctor. Over the next century the collection grew to more than "
        "80,000 items, and in 1998 the library moved into a former textile mill by the river. "
        "Today it also lends tools, board games and sewing machines.",
        ("When did the library open?", "What unusual things does the library lend today?"),
    ),
    (
        "Honeybees communicate the location of flowers through a movement called the waggle "
        "dance. A returning forager walks in a figure-eight pattern, and the angle of the "
        "straight run tells the others the direction relative to the sun. The length of the "
        "waggle indicates how far away the food is.",
        ("What does the angle of the dance indicate?", "How do bees signal distance?"),
    ),
    (
        "Maya started a small bakery from her apartment during the winter of 2019. She sold "
        "sourdough loaves to neighbours through a messaging group, and within a year demand was "
        "high enough to rent a shop. She now employs four people and still bakes the first "
        "batch herself every morning at four.",
        ("How did Maya first sell her bread?", "How many people does she employ now?"),
    ),
    (
        "Glaciers form where more snow falls in winter than melts in summer. Over many years the "
        "snow compresses into dense ice, which begins to flow slowly downhill under its own "
        "weight. As glaciers move, they carve valleys and carry rocks for long distances.",
        ("What has to happen for a glacier to form?", "What do moving glaciers do to the land?"),
    ),
    (
        "The company's quarterly report showed revenue of 4.2 million dollars, up 12 percent "
        "from the same quarter last year. Costs rose faster, mainly because of new hires in the "
        "support team, so profit fell slightly. The board expects growth to continue once two "
        "new products launch in the autumn.",
        ("Why did profit fall?", "By how much did revenue grow?"),
    ),
    (
        "Before mechanical clocks, many towns relied on sundials and church bells to mark the "
        "time. Each town kept its own local time based on the sun, so noon in one city could "
        "differ by several minutes from noon in the next. Railways made this confusing, which "
        "is why standard time zones were introduced in the nineteenth century.",
        ("Why did railways push for time zones?", "How did towns keep time before clocks?"),
    ),
    (
        "Our neighbourhood garden has twenty raised beds that members rent for a small yearly "
        "fee. Members must water their own beds, but the compost bins and tools are shared. "
        "Every September the garden hosts a harvest party where everyone brings a dish made "
        "with something they grew.",
        ("What is shared in the garden?", "What happens every September?"),
    ),
    (
        "The axolotl is a salamander from the lakes around Mexico City. Unlike most amphibians, "
        "it keeps its gills and lives in water its whole life. It is famous among scientists "
        "for its ability to regrow lost limbs, parts of its heart and even parts of its brain. "
        "In the wild it is critically endangered.",
        ("Where does the axolotl come from?", "Why are scientists interested in it?"),
    ),
    (
        "The new software update changes how files are saved. Documents are now stored in the "
        "cloud by default, and a copy is kept on the device only if the user turns on offline "
        "mode. The update also adds a dark theme and removes the old export-to-fax feature.",
        ("Where are documents saved after the update?", "Which feature was removed?"),
    ),
    (
        "Marathon runners often talk about 'hitting the wall' at around the 30-kilometre mark. "
        "At that point the body has used up most of its stored glycogen and must rely more on "
        "fat, which releases energy more slowly. Eating carbohydrates during the race can delay "
        "or prevent the problem.",
        ("What causes hitting the wall?", "How can runners avoid it?"),
    ),
    (
        "In 1854 a cholera outbreak killed hundreds of people near Broad Street in London. The "
        "physician John Snow mapped the deaths and noticed they clustered around one water "
        "pump. After the pump's handle was removed, new cases dropped, and his work helped "
        "show that cholera spreads through contaminated water.",
        ("What did John Snow map?", "What did his work help to show?"),
    ),
    (
        "Solar panels produce the most electricity around midday, but households often use the "
        "most in the evening. Home batteries store the extra energy from the afternoon so it "
        "can be used after sunset. Without a battery, the surplus is usually sold back to the "
        "grid at a low price.",
        ("Why are home batteries useful?", "What happens to surplus power without a battery?"),
    ),
    (
        "The school trip to the coast is planned for 14 June. Buses leave the main gate at 7:30 "
        "and return around 18:00. Students need a packed lunch, a hat and a signed permission "
        "form, which must be handed in by 1 June. The trip costs 25 euros per student.",
        ("When must the permission form be handed in?", "What should students bring?"),
    ),
    (
        "Chess probably developed from an Indian game called chaturanga around the sixth "
        "century. It spread to Persia and then to Europe, where the rules slowly changed. The "
        "queen, once a weak piece that moved one square diagonally, became the strongest piece "
        "on the board in the fifteenth century.",
        ("Where did chess probably come from?", "How did the queen change?"),
    ),
    (
        "Sleep happens in cycles of roughly ninety minutes. Each cycle moves from light sleep "
        "into deep sleep and then into REM sleep, when most vivid dreams occur. Waking up at "
        "the end of a cycle usually feels easier than waking in the middle of deep sleep.",
        ("How long is a sleep cycle?", "When do most vivid dreams happen?"),
    ),
    (
        "Thank you for your order. Your parcel left our warehouse on Tuesday and should arrive "
        "within three to five working days. If it has not arrived by next Friday, reply to this "
        "email with your order number and we will send a replacement free of charge.",
        ("What should the customer do if the parcel is late?", "When did the parcel leave?"),
    ),
    (
        "Lichens look like single plants, but each one is a partnership between a fungus and an "
        "alga or a bacterium. The partner makes food through photosynthesis, while the fungus "
        "provides shelter and holds water. Because they are sensitive to air pollution, lichens "
        "are often used to monitor air quality.",
        ("What is a lichen made of?", "Why are lichens used to monitor air quality?"),
    ),
    (
        "The city plans to close the old swimming pool in March for a full renovation. The new "
        "pool will have a separate children's area, a lift for wheelchair users and solar water "
        "heating. Until it reopens, residents can use the sports centre in the north of the "
        "city at the same price.",
        ("What features will the new pool have?", "Where can residents swim in the meantime?"),
    ),
)

SUMMARY_ASKS = (
    "Summarise this passage in one sentence:\n\n{}",
    "Give a short summary of the following text.\n\n{}",
    "What is the main point of this paragraph?\n\n{}",
    "Write a two-bullet summary of this:\n\n{}",
    "Summarize for a busy reader in under 20 words:\n\n{}",
)
CONTEXT_ASKS = (
    "Read the passage and answer the question.\n\nPassage: {}\n\nQuestion: {}",
    "{}\n\nBased on the text above, {}",
    "Context: {}\n\nAnswer using only the context: {}",
)

TEMPLATES: dict[str, tuple[str, ...]] = {
    "explanation": (
        "Explain {} in simple terms.",
        "I never really understood {}. Could you explain it?",
        "Can you explain {} to a ten-year-old?",
        "What should everyone know about {}?",
        "Give me a short explanation of {}, with an everyday example.",
    ),
    "definition": (
        "What is {}?",
        "Define {} in one or two sentences.",
        "Explain what {} is.",
        "What is meant by {}? Give an example.",
    ),
    "comparison": (
        "What is the difference between {} and {}?",
        "Compare {} and {}.",
        "How are {} and {} similar, and how are they different?",
        "Explain the main differences between {} and {}.",
    ),
    "howto": (
        "How do I {}?",
        "What are the steps to {}?",
        "Give me a short checklist to {}.",
        "I'm a complete beginner. What's the easiest way to {}?",
    ),
    "creative": (
        "Write a haiku about {}.",
        "Write a short poem about {}.",
        "Write a 100-word story about {}.",
        "Write a limerick about {}.",
        "Write a short children's story about {}.",
    ),
    "conversation": (
        "What do you think about {}?",
        "Can you give me some advice on {}?",
        "I've been thinking a lot about {} lately. Any thoughts?",
        "My friend asked me about {} and I didn't know what to say. How would you answer?",
    ),
    "translation": (
        "Translate into French: '{}'",
        "Translate into Spanish: '{}'",
        "Translate into German: '{}'",
        "How would you say '{}' in Spanish?",
        "Translate this sentence to German: '{}'",
        "Give me the French translation of '{}'",
    ),
    "coding": (
        "Write a Python function that {}.",
        "In Python, how can I write a function that {}? Please include an example call.",
        "Write a short Python function with a docstring that {}.",
    ),
    "rewriting": (
        "Fix the grammar and spelling: '{}'",
        "Rewrite this sentence more formally: '{}'",
        "Paraphrase the following sentence: '{}'",
        "Make this sentence clearer: '{}'",
    ),
    "extraction": (
        "Classify the sentiment of this review as positive, negative or neutral: '{}'",
        "Is this customer review positive or negative? Explain briefly. '{}'",
    ),
}

TOPICS: dict[str, tuple[str | tuple[str, str], ...]] = {
    "explanation": (
        "photosynthesis", "inflation", "the water cycle", "gravity", "DNA", "black holes",
        "machine learning", "the stock market", "plate tectonics", "the greenhouse effect",
        "the human heart", "electricity", "the internet", "encryption", "evolution",
        "rainbows", "magnetism", "the immune system", "supply and demand", "volcanoes",
        "tides", "the French Revolution", "the Industrial Revolution", "democracy",
        "recycling", "sound waves", "nuclear power", "antibiotics", "the Cold War",
        "cloud computing", "blockchain", "opportunity cost", "the placebo effect",
        "composting", "wind turbines", "the Silk Road", "the metric system", "solar eclipses",
        "interest rates", "human memory", "friction", "static electricity",
        "taxes", "the Renaissance", "earthquakes", "password managers", "3D printing",
        "hurricanes", "the food chain", "credit scores", "caffeine", "muscle growth",
        "the nitrogen cycle", "binary numbers", "operating systems", "sunburn",
    ),
    "definition": (
        "a metaphor", "an ecosystem", "a noun", "a prime number", "an algorithm", "a budget",
        "biodiversity", "a mortgage", "a sonnet", "an atom", "a peninsula", "empathy",
        "a hypothesis", "GDP", "a variable in programming", "irony", "a molecule",
        "a democracy", "a carnivore", "an invoice", "a protein", "a simile", "a glacier",
        "a dividend", "a pixel", "a paradox", "inertia", "a delta in geography", "a compiler",
        "a fossil", "a haiku", "a franchise", "an alloy", "a palindrome", "a watershed",
        "a recession", "a verb tense", "a catalyst", "an API", "an idiom", "a mammal",
        "a spreadsheet", "a firewall", "mindfulness", "a tariff", "photosynthesis",
    ),
    "comparison": (
        ("a lake", "a pond"), ("weather", "climate"), ("a frog", "a toad"),
        ("Python", "JavaScript"), ("baking soda", "baking powder"), ("a crocodile", "a lizard"),
        ("RAM", "storage"), ("a democracy", "a monarchy"), ("stocks", "bonds"),
        ("a violin", "a viola"), ("jogging", "swimming"), ("a laptop", "a tablet"),
        ("a hurricane", "a tornado"), ("butter", "margarine"), ("a debit card", "a credit card"),
        ("an email", "a letter"), ("a comet", "an asteroid"), ("hardware", "software"),
        ("a city", "a town"), ("a novel", "a short story"), ("a loan", "a grant"),
        ("a rabbit", "a hare"), ("wool", "cotton"), ("a train", "a plane for short trips"),
        ("yoga", "pilates"), ("a microwave", "an oven"), ("a fruit", "a vegetable"),
        ("a rental car", "public transport on holiday"), ("a cold", "the flu"),
        ("an ebook", "a paper book"), ("a museum", "a gallery"), ("speed", "velocity"),
        ("a mountain", "a hill"), ("a cat", "a dog as a first pet"),
    ),
    "howto": (
        "make a cup of green tea", "start a vegetable garden", "learn to touch type",
        "prepare for a job interview", "plan a birthday party", "unclog a kitchen sink",
        "bake chocolate chip cookies", "write a cover letter", "back up my phone",
        "train a puppy to sit", "fold a fitted sheet", "improve my handwriting",
        "meditate for ten minutes", "make homemade pizza dough", "paint a room",
        "organise a small closet", "start a book club", "sharpen a kitchen knife",
        "plan a road trip", "make a simple website", "learn a new language on my own",
        "keep a houseplant alive", "write a short speech", "ride a bike in traffic safely",
        "make my own candles", "prepare for a long flight", "clean my laptop keyboard",
        "make a paper airplane that flies far", "set up a home office", "brew cold brew coffee",
        "sew on a button", "take better photos with my phone", "reduce my screen time",
        "learn to juggle", "cook rice on the stove", "make a weekly meal plan",
        "start journaling", "change a light bulb safely", "make friends at a new job",
        "prepare for a 5 km run",
    ),
    "creative": (
        "autumn leaves", "a rainy city street", "a lost umbrella", "the moon", "an old library",
        "a friendly dragon", "a mountain village", "a lonely robot", "the smell of fresh "
        "bread", "a garden in spring", "a time-travelling cat", "a busy train station",
        "a grandmother's kitchen", "a summer storm", "a penguin who hates the cold",
        "a message in the sand", "a secret door in a school", "a broken clock",
        "the last day of school", "a dog who loves the sea", "a forgotten birthday",
        "a paper boat", "a snowman in the sun", "a kite on a windy day",
        "a tiny house in the woods", "a clumsy wizard", "the first day of a new job",
        "a music festival", "a talking tree", "a bicycle tour",
    ),
    "conversation": (
        "learning to play chess as an adult", "working four days a week",
        "keeping a plant-based diet on a budget", "staying in touch with old friends",
        "taking a year off before university", "living in the countryside",
        "starting a side business", "how much screen time kids should have",
        "keeping a gratitude journal", "buying second-hand clothes",
        "getting back into exercise after an injury", "whether to get a cat or a dog",
        "managing stress at work", "learning to swim at 30", "travelling alone for the "
        "first time", "saving for retirement in my twenties",
        "setting boundaries with family", "choosing a university major",
        "waking up earlier", "dealing with a difficult neighbour",
    ),
    "translation": (
        "Where is the nearest pharmacy?", "I would like a coffee with milk, please.",
        "My brother lives in a small village near the sea.", "What time does the shop close?",
        "We are going to the cinema tonight.", "The children are playing in the garden.",
        "I have been learning the piano for two years.", "Could you recommend a good "
        "restaurant?", "It is raining, so take an umbrella.", "The train is twenty minutes "
        "late.", "I don't understand, could you repeat that?", "This book is very interesting.",
        "My favourite season is spring.", "How much does this jacket cost?",
        "We need three tickets for tomorrow.", "She is a teacher at the primary school.",
        "The soup is too hot.", "I lost my phone at the airport.", "Happy birthday, my friend!",
        "The meeting starts at nine o'clock.", "Turn left at the second traffic light.",
        "I am allergic to peanuts.", "The hotel has a beautiful view of the lake.",
        "Can I pay by card?", "Our dog loves long walks.", "Tomorrow will be sunny and warm.",
        "I usually cook dinner at seven.", "The library is closed on Sundays.",
        "He forgot his keys at home again.", "Thank you very much for your help.",
        "Is there a bus to the city centre?", "I would like to open a bank account.",
        "The concert was wonderful.", "My grandparents live in the mountains.",
        "Please close the window, it is cold.", "What is your favourite film?",
    ),
    "coding": (
        "returns the largest number in a list without using max()",
        "counts how many vowels are in a string",
        "removes duplicates from a list while keeping the original order",
        "merges two sorted lists into one sorted list",
        "returns the n-th Fibonacci number using a loop",
        "checks whether a number is prime", "reverses the words in a sentence",
        "converts a temperature from Celsius to Fahrenheit",
        "counts how often each word appears in a text",
        "returns True if two strings are anagrams of each other",
        "flattens a list of lists into a single list",
        "computes the factorial of a non-negative integer",
        "finds the second smallest number in a list",
        "capitalises the first letter of every word in a string",
        "checks whether a year is a leap year",
        "returns the sum of the digits of an integer",
        "splits a list into chunks of a given size",
        "finds the most common character in a string",
        "converts a Roman numeral to an integer",
        "checks whether a string contains only digits",
        "returns the intersection of two lists",
        "computes the average of the values in a dictionary",
        "removes all punctuation from a string",
        "returns the indices of all occurrences of a value in a list",
        "validates that a password is at least 8 characters long and contains a digit",
        "reads a text file and returns the number of lines",
        "groups a list of words by their first letter",
        "rotates a list by k positions",
    ),
    "rewriting": (
        "their going to the park tomorow but it might rains",
        "i dont no where my keys is", "The datas shows that sales has increased alot.",
        "we was very exciting about the trip", "Can u send me the file when u got time",
        "He don't like vegetables, he eat only meat.",
        "The reason why is because the bus was late.",
        "Me and my sister has went to the concert last night.",
        "Its a nice day, lets go outside and enjoy it's sunshine.",
        "The results of the test was suprising for everybody.",
        "I could of finished sooner if I had more time.",
        "Everyone should bring their own lunch, there will be no food provided.",
        "Less people came to the meeting then we expected.",
        "She was laying on the sofa when the phone rung.",
        "Between you and I, the project is behind schedule.",
        "The manager said we needs to finish the report until friday.",
    ),
    "extraction": (
        "Arrived two days early and works perfectly. Very happy with it.",
        "The battery died after a week. I want my money back.",
        "It's okay. Does what it says, nothing special.",
        "Best pizza in town, the crust is amazing!",
        "The hotel room was dirty and the staff were rude.",
        "Delivery was quick but the box was damaged.",
        "I've bought this shampoo three times now, love the smell.",
        "The movie was far too long and the ending made no sense.",
        "Decent headphones for the price, although the bass is weak.",
        "The teacher explained everything clearly and patiently.",
        "Stopped working after the first wash. Disappointing.",
        "The app is fine, I use it sometimes.",
        "Friendly service and a lovely view from the terrace.",
        "The instructions were confusing and a screw was missing.",
        "Comfortable shoes, I walked all day without any pain.",
        "Not bad, not great. The colour is a bit different from the photo.",
    ),
}


def _templated(category: str) -> Iterator[str]:
    """Each topic takes the category's phrasings in turn: two of them for the short lists."""
    templates = TEMPLATES[category]
    topics = TOPICS[category]
    uses = 2 if len(topics) < 45 else 1
    for i, topic in enumerate(topics):
        args = topic if isinstance(topic, tuple) else (topic,)
        for j in range(uses):
            yield templates[(i + j) % len(templates)].format(*args)


def _passage_prompts() -> Iterator[tuple[str, str]]:
    for i, (passage, questions) in enumerate(PASSAGES):
        yield "summarization", SUMMARY_ASKS[i % len(SUMMARY_ASKS)].format(passage)
        yield "summarization", SUMMARY_ASKS[(i + 2) % len(SUMMARY_ASKS)].format(passage)
        for j, question in enumerate(questions):
            ask = CONTEXT_ASKS[(i + j) % len(CONTEXT_ASKS)]
            if ask.startswith("{}\n\nBased"):
                question = question[0].lower() + question[1:]
            yield "qa_context", ask.format(passage, question)


def _math_prompts() -> Iterator[str]:
    """Word problems whose numbers vary with the index, so no two are alike."""
    for i in range(40):
        a, b, c = 3 + (7 * i) % 23, 2 + (5 * i) % 11, 4 + (3 * i) % 9
        yield (
            f"A bakery sells {a * 4} croissants in the morning and {b * 3} in the afternoon. "
            f"Each croissant costs ${c}.50. How much money does it make in a day?",
            f"Tom has {a + b} marbles. He gives {b} to his sister and then buys {c} more. "
            "How many marbles does he have now?",
            f"A car uses {c + 2} litres of fuel per 100 km. How much fuel does it need for a "
            f"{a * 20} km trip?",
            f"What is {a * 13} multiplied by {b + 6}? Show your working.",
            f"A class of {a + 17} students is split into groups of {c}. How many full groups are "
            "there, and how many students are left over?",
            f"If {b} notebooks cost ${b * c}, how much do {a} notebooks cost?",
            f"A recipe needs {c * 50} g of flour for {b} people. How much flour is needed for "
            f"{b + a % 5 + 1} people?",
            f"Anna reads {c * 5} pages a day. Her book has {c * 5 * a + b} pages. How many days "
            "will it take her to finish it?",
        )[i % 8]


def _entries() -> Iterator[tuple[str, str]]:
    for category, prompts in HANDWRITTEN.items():
        for prompt in prompts:
            yield category, prompt
    yield from _passage_prompts()
    for prompt in _math_prompts():
        yield "math", prompt
    for category in TEMPLATES:
        for prompt in _templated(category):
            yield category, prompt


def build() -> list[dict[str, str]]:
    """All prompts in a fixed order; raises if two are the same."""
    rows = [{"category": category, "prompt": prompt} for category, prompt in _entries()]
    seen: set[str] = set()
    for row in rows:
        if row["prompt"] in seen:
            raise ValueError(f"duplicate prompt: {row['prompt']!r}")
        seen.add(row["prompt"])
    return rows


def write(rows: Sequence[dict[str, str]], path: Path = OUTPUT) -> None:
    lines = (json.dumps(row, ensure_ascii=False) for row in rows)
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


if __name__ == "__main__":
    write(build())
