"""Japanese news-like text, generated: no copied news. Sentences are composed from the word lists
below (written for this file) by a few templates, with the punctuation, quotes, numbers and Latin
abbreviations that Japanese news holds, and no spaces. ``articles(n)`` gives titles and bodies of
about the length of a BBC article (~2,000 characters)."""
from __future__ import annotations

import random

PLACES = ["東京都", "大阪府", "北海道", "福岡市", "名古屋市", "横浜市", "京都市", "沖縄県",
          "広島市", "仙台市", "神戸市", "札幌市", "新潟県", "長野県", "熊本県"]
ACTORS = ["政府", "首相", "日本銀行", "財務省", "厚生労働省", "国土交通省", "経済産業省", "専門家",
          "市民団体", "大手企業", "労働組合", "野党", "与党", "警察", "気象庁", "研究チーム",
          "自治体", "消費者団体", "商工会議所", "大学の研究者"]
TOPICS = ["新しい交通計画", "来年度の予算案", "経済対策", "物価の上昇", "賃金の引き上げ",
          "金融政策", "再生可能エネルギー", "少子化対策", "防災計画", "観光の回復", "半導体の供給",
          "医療制度の改革", "地域の人口減少", "外国人労働者の受け入れ", "円安の影響", "株価の動き",
          "住宅価格", "教育の無償化", "農業の後継者不足", "港湾の整備"]
VERBS_PAST = ["を発表した", "を決定した", "について説明した", "を明らかにした", "を公表した",
              "を了承した", "に合意した", "を見直した"]
VERBS_POLITE = ["を検討しています", "を進める方針です", "を急ぐ考えです", "に取り組むとしています",
                "を注視しています"]
TIMES = ["月曜日", "火曜日", "水曜日", "木曜日", "金曜日", "週末", "先月", "今月", "昨年", "今年度",
         "来年", "今後数年"]
EFFECTS = ["影響が広がる可能性がある", "市場に安心感が広がった", "反発の声も上がっている",
           "効果を疑問視する見方もある", "実施には時間がかかる見通しだ", "負担が増えるおそれがある",
           "議論が続いている", "期待が高まっている"]
QUOTES = ["状況を慎重に見極めたい", "できるだけ早く対応する", "市民の理解を得ることが重要だ",
          "これまでにない取り組みだ", "課題は山積している", "前向きに受け止めている"]
LATIN = ["G7", "AI", "GDP", "NHK", "IT", "EU", "WHO", "NPO"]


def _number(rng: random.Random) -> str:
    return rng.choice([f"{rng.randint(2, 99)}%", f"{rng.randint(1, 9)}兆円",
                       f"{rng.randint(10, 999)}億円", f"{rng.randint(2, 50)}万人",
                       f"{rng.randint(2020, 2030)}年",
                       f"{rng.randint(1, 12)}月{rng.randint(1, 28)}日"])


def sentence(rng: random.Random) -> str:
    """One sentence, with its end (。, rarely ！ or ？, or 。」 inside a quote)."""
    place, actor, topic = rng.choice(PLACES), rng.choice(ACTORS), rng.choice(TOPICS)
    template = rng.randrange(7)
    if template == 0:
        return f"{actor}は{rng.choice(TIMES)}、{topic}{rng.choice(VERBS_PAST)}。"
    if template == 1:
        return f"{place}の{actor}は{topic}{rng.choice(VERBS_POLITE)}。"
    if template == 2:
        return (f"{actor}の担当者は「{rng.choice(QUOTES)}」と述べ、{topic}について"
                f"{rng.choice(EFFECTS)}との認識を示した。")
    if template == 3:
        return f"{topic}をめぐっては、{_number(rng)}という試算もあり、{rng.choice(EFFECTS)}。"
    if template == 4:
        return (f"{rng.choice(LATIN)}の会合では{topic}も議題となり、{actor}は対応"
                f"{rng.choice(VERBS_POLITE)}。")
    if template == 5:
        return f"{place}では{_number(rng)}、{topic}に関する調査の結果が公表された。"
    return rng.choice([f"{topic}は本当に必要なのか？", f"{actor}の対応に注目が集まる！",
                       f"「{rng.choice(QUOTES)}。」"])


def article(rng: random.Random, chars: int = 2_000) -> tuple[str, str]:
    """(title, body): a body of about ``chars`` characters, paragraphs apart by a newline."""
    title = f"{rng.choice(ACTORS)}、{rng.choice(TOPICS)}{rng.choice(VERBS_PAST)}"
    paragraphs, length = [], 0
    while length < chars:
        paragraph = "".join(sentence(rng) for _ in range(rng.randint(2, 4)))
        paragraphs.append(paragraph)
        length += len(paragraph) + 1
    return title, "\n".join(paragraphs)


def articles(n: int, seed: int = 0, chars: int = 2_000) -> list[tuple[str, str]]:
    """``n`` (title, body) pairs, of about ``chars`` characters on average (from half to 1.6 times
    that, as most BBC articles are; theirs average 2,259)."""
    rng = random.Random(seed)
    return [article(rng, int(chars * rng.uniform(0.5, 1.6))) for _ in range(n)]
